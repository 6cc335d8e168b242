"""``docs/configuration.md``, generated from the settings models (``shared/settings.py``).

    python -m mmserve.config_docs            the page, to stdout
    python -m mmserve.config_docs --write    rewrite docs/configuration.md
    python -m mmserve.config_docs --check    exit 1 when docs/configuration.md is stale (CI: tests/unit)

One table per service: each setting's name, environment variable, flag, default and description,
then the ``MMSERVE_*`` variables read by name (``shared.env_check.OTHER_VARS``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from shared.env_check import OTHER_VARS, STRICT_FLAG, STRICT_VAR, env_names_of, service_settings

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

COMMANDS = {
    "gateway": ("Gateway", "`mmserve gateway`, `python -m gateway`"),
    "encoder": ("Encoder", "`mmserve encoder`"),
    "llm": ("LLM service", "`mmserve llm`"),
}

HEADER = f"""# Configuration

<!-- Generated from shared/settings.py by `python -m mmserve.config_docs --write`; do not edit by
hand: tests/unit/test_config_docs.py fails while this page is stale. -->

Every setting of a service is an environment variable `MMSERVE_<SERVICE>_<NAME>` and a flag of
its command (`mmserve gateway|encoder|llm --help`); a flag wins over the environment, the
environment over the default. List settings take a comma-separated list or a JSON list.

At start each service checks its `MMSERVE_*` variables: one that names none of its settings is
a warning naming the nearest real one (`MMSERVE_GATEWAY_FAIL_THRESHOLD`: nearest
`MMSERVE_GATEWAY_HEALTH_FAIL_THRESHOLD`); with `{STRICT_FLAG}` or `{STRICT_VAR}=1` it is a
start-up error, exit code 2. `mmserve up` checks every service's. A variable of another service
(one `.env` shared by every Compose service) is no typo and passes.

The models and the engine's C kernels are cached under one root, `MMSERVE_CACHE_DIR` (default
`~/.cache/mmserve`; the older `MMSERVE_CACHE` is still read, with a deprecation warning).
"""


def command_flags(service: str) -> dict[str, list[str]]:
    """Field -> its flags, read from the parser of ``mmserve <service>`` itself (``mmserve.cli``:
    the field's kebab-case name, ``--no-`` for a boolean, vLLM's aliases)."""
    from mmserve.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: list(a.option_strings) for a in sub.choices[service]._actions if a.option_strings}


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return ""


def default_text(name: str, info: FieldInfo) -> str:
    """The default as a table cell: ``required``, ``unset`` (None), ``empty`` or the value."""
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, tuple)):
        return f"`{','.join(map(str, value))}`" if value else "empty"
    if value == "":
        return "empty"
    cell = f"`{value}`"
    if isinstance(value, int) and "bytes" in name and _size(value):
        cell += f" ({_size(value)})"
    return cell


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def service_table(service: str, settings_cls: type[BaseSettings]) -> list[str]:
    parsed = command_flags(service)
    rows = ["| setting | variable | flag | default | description |", "|---|---|---|---|---|"]
    for name, info in settings_cls.model_fields.items():
        variables = ", ".join(f"`{v}`" for v in env_names_of(settings_cls, name))
        flag = ", ".join(f"`{f}`" for f in parsed.get(name, [])) or "none"
        rows.append(f"| `{name}` | {variables} | {flag} | {default_text(name, info)} | "
                    f"{_cell(info.description or '')} |")
    return rows


def render() -> str:
    lines = [HEADER]
    for service, cls in service_settings().items():
        title, command = COMMANDS[service]
        lines += [f"## {title}", "", f"{command}; every variable starts with `{cls.model_config['env_prefix']}`.",
                  "", *service_table(service, cls), ""]
    lines += ["## Other variables", "",
              "Read by name rather than as a setting: by `mmserve up`, by `compose.yaml` (from `.env`), by the "
              "benchmarks and scripts. Every service knows them.", "",
              "| variable | read by |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(what)} |" for name, what in OTHER_VARS.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmserve.config_docs", description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite {PAGE.name}")
    mode.add_argument("--check", action="store_true", help=f"exit 1 when {PAGE.name} is stale")
    args = ap.parse_args(argv)
    page = render()
    if args.write:
        PAGE.write_text(page)
        print(f"wrote {PAGE}")
    elif args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE} is stale: run python -m mmserve.config_docs --write", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
