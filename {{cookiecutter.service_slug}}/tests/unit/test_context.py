"""Request context: validation, role flattening, capture and restore."""

import pytest

from {{ cookiecutter.package_name }}.building_blocks.kernel.context_values import (
    InvalidContextError,
    validate_correlation_id,
)
from {{ cookiecutter.package_name }}.building_blocks.kernel.hops import capture, restored
from {{ cookiecutter.package_name }}.building_blocks.kernel.request_context import (
    RequestContext,
    current_context,
    use_context,
)
from {{ cookiecutter.package_name }}.building_blocks.kernel.roles import (
    MAX_ROLES_LENGTH,
    flatten_roles,
)

pytestmark = pytest.mark.unit


def test_roles_are_flattened_and_capped_at_512_characters_on_role_boundaries() -> None:
    roles = [f"role-{i:04d}" for i in range(100)]  # 9 chars each
    flattened = flatten_roles(roles)
    assert flattened is not None
    assert len(flattened) <= MAX_ROLES_LENGTH
    assert flattened.split(",") == roles[: len(flattened.split(","))]
    assert flatten_roles(["a,b", " ", "c"]) == "ab,c"


@pytest.mark.parametrize("value", ["x" * 65, "", "-starts-with-dash", "has space", "semi;colon", "é"])
def test_bad_correlation_ids_are_refused(value: str) -> None:
    with pytest.raises(InvalidContextError):
        validate_correlation_id(value)


def test_capture_and_restore_replace_rather_than_merge() -> None:
    with use_context(RequestContext(tenant_id="t1", user_id="u1", roles=("a", "b"), correlation_id="c1")):
        captured = capture()
    assert captured.user_roles == "a,b"
    with use_context(RequestContext(tenant_id="other", user_id="intruder")):
        with restored(captured, authentication_type="outbox") as context:
            assert (context.tenant_id, context.user_id, context.roles) == ("t1", "u1", ("a", "b"))
            assert context.authentication_type == "outbox"
            assert current_context() is context
        assert current_context().user_id == "intruder"
