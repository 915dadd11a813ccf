"""What cookiecutter answered when this service was generated.

The only module in the package written by the template: every other module reads these names
(or settings) at run time, so the code you read is the code that runs.
"""

from typing import Final

SERVICE_NAME: Final = {{ cookiecutter.service_name | string_literal }}
SERVICE_SLUG: Final = {{ cookiecutter.service_slug | tojson }}
DESCRIPTION: Final = {{ cookiecutter.description | string_literal }}
DEFAULT_BROKER: Final = {{ cookiecutter.broker | tojson }}
