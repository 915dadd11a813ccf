"""The AsyncAPI 3.0 document of the service, built from the registered messages.

Every integration event the service knows gets a channel (its broker address) and a message
schema (from its pydantic model); every consumer gets a receive operation. A test fails when an
integration event has no channel, so the document cannot drift from the code.

The document is public (``GET /asyncapi`` needs no token), so the server entry names the broker's
hosts and path only: user, password and query string (``?password=``, TLS file paths) of
``MESSAGE_BUS__URL`` never leave the process."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from outbox_kit.application.handlers import HandlerRegistry
from outbox_kit.application.messages import IntegrationEvent, MessageRegistry
from outbox_kit.transports.envelope import SIGNATURE, SIGNED_HEADERS
from outbox_kit.transports.settings import EndpointNames, MessageBusSettings


def _key(name: str) -> str:
    return name.replace(".", "_").replace("-", "_")


def public_server(url: str | None, protocol: str) -> dict[str, str]:
    """The AsyncAPI server object of a broker URL, without credentials or query.

    Handles ``scheme://user:pass@host:port/path?query`` and Kafka's scheme-less
    ``user:pass@host1:9092,host2:9092`` bootstrap lists."""
    if not url:
        return {"host": "in-process", "protocol": protocol}
    parts = urlsplit(url if "://" in url else f"//{url}")
    hosts = ",".join(host.rpartition("@")[2] for host in parts.netloc.rpartition("@")[2].split(","))
    server = {"host": hosts, "protocol": protocol}
    if parts.path not in {"", "/"}:
        server["pathname"] = parts.path
    return server


def asyncapi_document(
    registry: MessageRegistry,
    handlers: HandlerRegistry,
    bus: MessageBusSettings,
    *,
    namespace: str,
    title: str,
    description: str,
) -> dict[str, Any]:
    """The document of a service called ``title``, whose broker names start with ``namespace``."""
    names = EndpointNames(namespace, bus.preserve_default_endpoint_names)
    headers_schema = {
        "type": "object",
        "properties": {h: {"type": "string"} for h in (*SIGNED_HEADERS, SIGNATURE)},
        "required": ["x-message-id", "x-event-name"],
    }
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for event in registry.classes(IntegrationEvent):
        key = _key(event.message_name)
        messages[key] = {
            "name": event.message_name,
            "title": event.__name__,
            "summary": (event.__doc__ or "").strip().splitlines()[0] if event.__doc__ else "",
            "contentType": "application/json",
            "headers": headers_schema,
            "payload": event.model_json_schema(),
        }
        channels[key] = {
            "address": names.channel(event.message_name),
            "messages": {key: {"$ref": f"#/components/messages/{key}"}},
        }
        operations[f"publish_{key}"] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{key}"},
            "summary": "Published only by the outbox processor",
        }
    for consumer in handlers.consumers:
        key = _key(consumer.event_type.message_name)
        operations[f"consume_{_key(consumer.name)}"] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{key}"},
            "summary": f"{consumer.name} (queue {names.queue(consumer.name)}, deduplicated by the inbox)",
        }
    return {
        "asyncapi": "3.0.0",
        "info": {"title": title, "version": "1.0.0", "description": description},
        "defaultContentType": "application/json",
        "servers": {"default": public_server(bus.url, bus.transport.value)},
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages},
    }
