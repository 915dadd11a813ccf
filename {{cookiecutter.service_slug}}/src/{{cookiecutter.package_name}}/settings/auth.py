"""Bearer tokens: HS256 JWTs; production refuses the published development secret, a key shorter
than its hash (RFC 7518 3.2), and a token without issuer and audience. Every start refuses an
algorithm other than HS256, HS384 and HS512: with ``none`` or an RSA name the service started and
then refused every token."""

from __future__ import annotations

from pydantic import BaseModel, Field, SecretStr, field_validator

DEV_JWT_SECRET = "dev-only-secret-change-me-0123456789abcdef"  # noqa: S105 (refused in production)

# RFC 7518 section 3.2: an HMAC key at least as long as the hash output.
MIN_JWT_SECRET_BYTES = {"HS256": 32, "HS384": 48, "HS512": 64}


class AuthSettings(BaseModel):
    """Bearer JWTs (HS256) carrying ``sub``, ``tenant`` and ``roles``."""

    jwt_secret: SecretStr = SecretStr(DEV_JWT_SECRET)
    jwt_algorithm: str = "HS256"
    jwt_issuer: str = ""
    jwt_audience: str = ""
    token_ttl_minutes: int = Field(default=60, ge=1)
    admin_role: str = "outbox-admin"
    operator_role: str = "outbox-operator"

    @field_validator("jwt_algorithm")
    @classmethod
    def _shared_secret_algorithm(cls, value: str) -> str:
        """Only the HMAC algorithms verify with a shared secret (``none`` verifies nothing)."""
        if value not in MIN_JWT_SECRET_BYTES:
            msg = (
                "AUTH__JWT_ALGORITHM must be HS256, HS384 or HS512 (tokens signed with the shared "
                f"secret), got {value!r}"
            )
            raise ValueError(msg)
        return value

    def refuse_in_production(self) -> None:
        """The development secret, a key shorter than its hash, or tokens not bound to an issuer
        and an audience (any service sharing the secret could mint ours) are refused."""
        secret = self.jwt_secret.get_secret_value()
        if secret == DEV_JWT_SECRET:
            msg = "AUTH__JWT_SECRET must be set in production"
            raise ValueError(msg)
        minimum = MIN_JWT_SECRET_BYTES[self.jwt_algorithm]
        if len(secret.encode()) < minimum:
            msg = (
                f"AUTH__JWT_SECRET must be at least {minimum} bytes for {self.jwt_algorithm}, "
                f"got {len(secret.encode())} (RFC 7518 3.2)"
            )
            raise ValueError(msg)
        for name, value in (("jwt_issuer", self.jwt_issuer), ("jwt_audience", self.jwt_audience)):
            if not value:
                msg = f"AUTH__{name.upper()} must be set in production (every token is checked against it)"
                raise ValueError(msg)
