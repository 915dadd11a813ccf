"""Every runtime knob, read from the environment (nested with ``__``, no prefix) and ``.env``.

Defaults follow the seed ADR (polling 2 s, processing delay 5 s, lease 300 s, five retries,
backoff base 10 s, batch 50, retention 7 days). The embedded default is a SQLite file and the
in-process transport, so a fresh checkout runs with no server at all.

``MESSAGE_BUS__ENABLE_OUTBOX`` and ``MESSAGE_BUS__ENABLE_INBOX`` are tri-state: unset resolves ON
for a broker transport and OFF for the in-process one (ADR-100). The resolved values are exposed
as ``outbox_enabled`` / ``inbox_enabled``; code never reads the raw fields.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Self

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .about import SERVICE_SLUG


class Environment(StrEnum):
    """Development allows conveniences (dev tokens, default secrets); production refuses them."""

    DEVELOPMENT = "development"
    PRODUCTION = "production"


class Transport(StrEnum):
    """Where integration events travel. In-process needs no server."""

    INPROCESS = "inprocess"
    RABBITMQ = "rabbitmq"
    KAFKA = "kafka"
    NATS = "nats"
    REDIS = "redis"


DEV_JWT_SECRET = "dev-only-secret-change-me-0123456789abcdef"  # noqa: S105 (refused in production)
# The signing key .env.example ships with, and the shortest key production accepts.
EXAMPLE_SIGNING_SECRET = "change-me-local-signing-key"  # noqa: S105 (refused in production)
MIN_PRODUCTION_KEY_LENGTH = 16
# RFC 7518 section 3.2: an HMAC key at least as long as the hash output.
MIN_JWT_SECRET_BYTES = {"HS256": 32, "HS384": 48, "HS512": 64}


class ApplicationSettings(BaseModel):
    """Identity of the running service."""

    namespace: str = Field(default="", description="Prefix for broker names; the slug when empty")
    instance_id: str = Field(default="", description="Processor id in leases; host:pid when empty")

    @property
    def resolved_namespace(self) -> str:
        return self.namespace or SERVICE_SLUG


class DatabaseSettings(BaseModel):
    """SQLite (aiosqlite) or PostgreSQL (asyncpg), chosen by the URL."""

    url: str = "sqlite+aiosqlite:///./service.db"
    echo: bool = False
    pool_size: int = Field(default=10, ge=1)
    sqlite_busy_timeout_ms: int = Field(default=10_000, ge=0)
    transient_retry_attempts: int = Field(default=3, ge=1)

    @property
    def is_postgresql(self) -> bool:
        return self.url.startswith("postgresql")


class MessageBusSettings(BaseModel):
    """The transport and the outbox/inbox switches (tri-state, see the module docstring)."""

    transport: Transport = Transport.INPROCESS
    url: str = ""
    enable_outbox: bool | None = None
    enable_inbox: bool | None = None
    preserve_default_endpoint_names: bool = False
    signing_keys: Annotated[dict[str, SecretStr], NoDecode] = Field(default_factory=dict)
    signing_key_id: str = ""
    allow_unsigned: bool = False
    max_delivery_attempts: int = Field(default=5, ge=1)
    redelivery_delay_seconds: float = Field(default=1.0, gt=0)
    database_outage_hold_seconds: float = Field(default=60.0, ge=0)
    max_header_bytes: int = Field(default=4096, ge=256)
    publish_timeout_seconds: float = Field(default=10.0, gt=0)
    circuit_failure_threshold: int = Field(default=5, ge=1)
    circuit_reset_seconds: float = Field(default=30.0, gt=0)
    kafka_create_topics: bool = True
    kafka_topic_partitions: int = Field(default=3, ge=1)
    kafka_replication_factor: int = Field(default=1, ge=1)

    @field_validator("signing_keys", mode="before")
    @classmethod
    def _parse_keys(cls, value: object) -> object:
        """Accept ``kid1:secret1,kid2:secret2`` from the environment."""
        if not isinstance(value, str):
            return value
        keys: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in value.split(","))):
            kid, sep, secret = item.partition(":")
            if not sep or not kid or not secret:
                msg = "MESSAGE_BUS__SIGNING_KEYS must look like 'kid:secret,kid2:secret2'"
                raise ValueError(msg)
            keys[kid] = secret
        return keys

    @property
    def is_broker(self) -> bool:
        return self.transport is not Transport.INPROCESS

    @property
    def outbox_enabled(self) -> bool:
        return self.is_broker if self.enable_outbox is None else self.enable_outbox

    @property
    def inbox_enabled(self) -> bool:
        return self.is_broker if self.enable_inbox is None else self.enable_inbox

    @property
    def active_key_id(self) -> str | None:
        if self.signing_key_id:
            return self.signing_key_id
        return next(iter(self.signing_keys), None)


class OutboxSettings(BaseModel):
    """The delivery knobs of the seed ADR, with its defaults."""

    polling_interval_seconds: float = Field(default=2.0, gt=0)
    processing_delay_seconds: float = Field(default=5.0, ge=0)
    lease_seconds: float = Field(default=300.0, gt=0)
    max_retries: int = Field(default=5, ge=1)
    retry_backoff_base_seconds: float = Field(default=10.0, gt=0)
    batch_size: int = Field(default=50, ge=1, le=10_000)
    delivery_concurrency: int = Field(
        default=8, ge=1, le=256, description="Rows of one batch delivered at once (PostgreSQL; 1 on SQLite)"
    )
    claim_window: int = Field(default=0, ge=0, description="Keyed rows scanned per claim; 0 = auto")
    retention_days: int = Field(default=7, ge=0)
    dead_letter_retention_days: int = Field(default=0, ge=0)
    cleanup_interval_seconds: float = Field(default=3600.0, gt=0)
    cleanup_batch_size: int = Field(default=1000, ge=1)
    immediate_dispatch: bool = True
    max_cascade_depth: int = Field(default=8, ge=1)
    shutdown_timeout_seconds: float = Field(default=5.0, gt=0)
    metrics_interval_seconds: float = Field(default=15.0, gt=0)

    @property
    def dead_letter_window_days(self) -> int:
        """How long dead letters are kept (and can be replayed); 0 = forever."""
        return self.dead_letter_retention_days or self.retention_days

    @property
    def effective_claim_window(self) -> int:
        return self.claim_window or 8 * self.batch_size


class InboxSettings(BaseModel):
    """Consumer-side deduplication records. Kept twice as long as outbox dead letters by
    default: a message older than the inbox remembers is refused as stale, and a dead letter
    replayed on the last day of its window must still be accepted."""

    retention_days: int = Field(default=14, ge=0)


class AuthSettings(BaseModel):
    """Bearer JWTs (HS256) carrying ``sub``, ``tenant`` and ``roles``."""

    jwt_secret: SecretStr = SecretStr(DEV_JWT_SECRET)
    jwt_algorithm: str = "HS256"
    jwt_issuer: str = ""
    jwt_audience: str = ""
    token_ttl_minutes: int = Field(default=60, ge=1)
    admin_role: str = "outbox-admin"
    operator_role: str = "outbox-operator"

    def refuse_in_production(self) -> None:
        """The development secret, a key shorter than its hash, or tokens not bound to an issuer
        and an audience (any service sharing the secret could mint ours) are refused."""
        secret = self.jwt_secret.get_secret_value()
        if secret == DEV_JWT_SECRET:
            msg = "AUTH__JWT_SECRET must be set in production"
            raise ValueError(msg)
        minimum = MIN_JWT_SECRET_BYTES.get(self.jwt_algorithm, MIN_JWT_SECRET_BYTES["HS256"])
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


class ApiSettings(BaseModel):
    """Where `run` and `api` listen, and the largest request body they read."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    max_body_bytes: int = Field(default=1_048_576, ge=1)


class LoggingSettings(BaseModel):
    """Plain text for people, JSON lines for machines."""

    level: str = "INFO"
    json_format: bool = False


class Tracing(StrEnum):
    """``none``: no spans (nothing imported); ``otel``: OpenTelemetry, exported over OTLP."""

    NONE = "none"
    OTEL = "otel"


class TelemetrySettings(BaseModel):
    """Tracing (metrics are always on, at ``/metrics``). The OTLP endpoint, service name and
    sampling come from OpenTelemetry's own ``OTEL_*`` variables."""

    tracing: Tracing = Tracing.NONE


class Settings(BaseSettings):
    """The root of every setting; build one per process in the container."""

    model_config = SettingsConfigDict(
        env_file=".env",
        env_file_encoding="utf-8",
        env_nested_delimiter="__",
        extra="ignore",
    )

    environment: Environment = Environment.DEVELOPMENT
    application: ApplicationSettings = ApplicationSettings()
    database: DatabaseSettings = DatabaseSettings()
    message_bus: MessageBusSettings = MessageBusSettings()
    outbox: OutboxSettings = OutboxSettings()
    inbox: InboxSettings = InboxSettings()
    auth: AuthSettings = AuthSettings()
    api: ApiSettings = ApiSettings()
    logging: LoggingSettings = LoggingSettings()
    telemetry: TelemetrySettings = TelemetrySettings()

    @property
    def is_production(self) -> bool:
        return self.environment is Environment.PRODUCTION

    @model_validator(mode="after")
    def _refuse_unsafe_combinations(self) -> Self:
        bus = self.message_bus
        if bus.is_broker and bus.enable_outbox is False:
            msg = (
                f"MESSAGE_BUS__ENABLE_OUTBOX=false is refused with the {bus.transport} transport: "
                "integration events would bypass the outbox and be lost on a crash"
            )
            raise ValueError(msg)
        if bus.signing_key_id and bus.signing_key_id not in bus.signing_keys:
            msg = f"MESSAGE_BUS__SIGNING_KEY_ID {bus.signing_key_id!r} is not in SIGNING_KEYS"
            raise ValueError(msg)
        if self.is_production:
            self.auth.refuse_in_production()
            if bus.is_broker and not bus.signing_keys and not bus.allow_unsigned:
                msg = (
                    "MESSAGE_BUS__SIGNING_KEYS must be set for a broker transport in production "
                    "(or set MESSAGE_BUS__ALLOW_UNSIGNED=true to accept unsigned context headers)"
                )
                raise ValueError(msg)
            weak = sorted(
                kid
                for kid, secret in bus.signing_keys.items()
                if secret.get_secret_value() == EXAMPLE_SIGNING_SECRET
                or len(secret.get_secret_value()) < MIN_PRODUCTION_KEY_LENGTH
            )
            if weak:
                msg = (
                    f"MESSAGE_BUS__SIGNING_KEYS {', '.join(weak)}: the example key or shorter than "
                    f"{MIN_PRODUCTION_KEY_LENGTH} characters is refused in production"
                )
                raise ValueError(msg)
        return self
