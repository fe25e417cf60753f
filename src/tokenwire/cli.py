"""The ``tokenwire`` command: ``prepare`` model assets, ``serve`` a model."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from tokenwire import __version__


def main(argv: Sequence[str] | None = None) -> int:
    from tokenwire.settings import add_serve_arguments, settings_from_args

    parser = argparse.ArgumentParser(prog="tokenwire", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tokenwire {__version__}")
    commands = parser.add_subparsers(dest="command")
    prepare = commands.add_parser("prepare", help="build a model asset and print its directory")
    prepare.add_argument("name")
    serve = commands.add_parser("serve", help="serve a model over HTTP")
    add_serve_arguments(serve)
    args, unknown = parser.parse_known_args(argv)

    if args.command == "prepare":
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        return _prepare(args.name)
    if args.command == "serve":
        try:
            settings = settings_from_args(args, unknown)
        except ValueError as exc:
            parser.error(str(exc))
        return _serve(settings)
    parser.print_help()
    return 2


def _prepare(name: str) -> int:
    from tokenwire import assets

    if name not in assets.ASSET_NAMES:
        print(
            f"unknown asset {name!r}; choose one of: {', '.join(assets.ASSET_NAMES)}",
            file=sys.stderr,
        )
        return 2
    path = assets.prepare(name, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(path)
    return 0


def _serve(settings) -> int:
    logging.basicConfig(
        level=settings.log_level.upper() if settings.log_level != "trace" else "DEBUG",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if settings.api_server_count > 1:
        from tokenwire.api.api_servers import serve_api_servers

        return serve_api_servers(settings)
    from tokenwire.api.app import create_app
    from tokenwire.api.server import GracefulServer, uvicorn_config

    app = create_app(settings)
    config = uvicorn_config(app, settings)
    server = GracefulServer(config, app.state.pipeline, settings.shutdown_timeout_s)
    server.run()
    return server.exit_code  # 1 once the engine died: a supervisor restarts the server


if __name__ == "__main__":
    sys.exit(main())
