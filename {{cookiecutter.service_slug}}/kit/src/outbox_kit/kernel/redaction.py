"""Credentials never leave the process inside a URL.

Every URL the service logs or shows (the development banner, readiness errors, any log line,
a library's included) has its password masked by :func:`mask_credentials`:
``postgresql://app:***@db/app``. The user name stays (it says which account failed); a URL
without a password is unchanged. :class:`CredentialMaskingFilter` applies it to every record a
handler writes, message and traceback; ``entrypoints.logging_setup`` puts it on the process's
one handler.
"""

from __future__ import annotations

import logging
import re

# scheme://user:password@ -- the password runs to the last '@' before the host, so a password
# with an unencoded '@' or ':' is masked whole.
_URL_CREDENTIALS = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s/?#@:]*):[^\s/?#]*@")


def mask_credentials(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` URL replaced by ``***``."""
    return _URL_CREDENTIALS.sub(r"\g<head>:***@", text)


class CredentialMaskingFilter(logging.Filter):
    """Masks URL passwords in what a handler writes: the message and the formatted traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_credentials(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = mask_credentials(record.exc_text)
        return True
