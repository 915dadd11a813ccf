"""``python -m <package>`` (and the script of the service's name): the kit's command line
(``outbox_kit.runtime.cli``: run, api, worker, migrate, token, outbox, asyncapi) for this
service's settings and container."""

from pathlib import Path

from outbox_kit.runtime import cli

from .container import build_container
from .settings import Settings

# Where alembic.ini and migrations/ are in a checkout (an installed copy finds them by
# ALEMBIC_CONFIG or the working directory, as the Dockerfile sets it).
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    cli.main(Settings, build_container, project=PROJECT_ROOT)


if __name__ == "__main__":
    main()
