"""``python -m <package>`` (and the script of the service's name): the kit's command line
(``outbox_kit.runtime.cli``: run, api, worker, migrate, token, outbox, asyncapi) for this
service's settings and container."""

from pathlib import Path

from outbox_kit.runtime import cli

from .about import SERVICE_NAME

# Where alembic.ini and migrations/ are in a checkout (an installed copy finds them by
# ALEMBIC_CONFIG or the working directory, as the Dockerfile sets it).
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    # By reference: imported once the command is known, so `--help` answers at once (the
    # container imports every context, the database driver and the brokers' clients).
    cli.main(
        f"{__package__}.settings:Settings",
        f"{__package__}.container:build_container",
        project=PROJECT_ROOT,
        description=SERVICE_NAME,
    )


if __name__ == "__main__":
    main()
