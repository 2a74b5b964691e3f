"""The ``kvpaging`` command: ``kvpaging serve MODEL [options]`` (see ``kvpaging serve --help``)."""

from __future__ import annotations

import argparse

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvpaging", description="kvpaging: a small LLM serving engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    from kvpaging.entrypoints.serve import add_serve_arguments, run  # the server's packages load only for `serve`

    add_serve_arguments(commands.add_parser(
        "serve", help="serve a model with an OpenAI-compatible API (like `vllm serve`)",
        description="Serve a model with an OpenAI-compatible API (like `vllm serve`)."))
    args = parser.parse_args(argv)
    if args.command == "serve":
        run(args)


if __name__ == "__main__":
    main()
