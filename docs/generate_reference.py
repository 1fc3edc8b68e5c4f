"""Write the generated reference pages: ``docs/configuration.md`` from the
``tsp`` config model (``ds_tsp/config.py``: each field's name, type, default,
valid values and docstring) and ``docs/cli.md`` from the ``ds-tsp``
subcommands' ``--help``. ``tests/test_docs.py`` fails when the committed pages
and these differ.

    python docs/generate_reference.py
"""

import ast
import inspect
import os
import sys

import ds_tsp.config as config
from ds_tsp.cli import build_parser

DOCS = os.path.dirname(os.path.abspath(__file__))
HELP_WIDTH = "100"  # argparse wraps --help to the terminal's COLUMNS: fixed, so the page does not depend on it

CONFIGURATION_HEADER = """# Configuration reference: the `tsp` section

Generated from `ds_tsp/config.py` by `python docs/generate_reference.py`; do not edit by hand.

The `tsp` section sits beside DeepSpeed's own sections in the ordinary
DeepSpeed JSON (or hjson) config. An unknown key, a value of the wrong type or
one out of range is refused at start-up, before any process group or weight
exists, with a message naming `tsp.<key>`, the value and what is expected.

```json
{
  "train_micro_batch_size_per_gpu": 1,
  "zero_optimization": {"stage": 1},
  "tsp": {"enabled": true, "size": 2}
}
```

| key | type | default | valid values | what it does |
|---|---|---|---|---|
"""

CLI_HEADER = """# `ds-tsp` command reference

Generated from `ds_tsp/cli.py` by `python docs/generate_reference.py`; do not edit by hand.
"""


def field_docstrings(model_class):
    """``{field: docstring}`` of a pydantic model: the string literal after each annotated field."""
    tree = ast.parse(inspect.getsource(model_class))
    body = tree.body[0].body
    docs = {}
    for statement, following in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def configuration_page():
    docs = field_docstrings(config.TSPConfig)
    rows = []
    for name, field in config.TSPConfig.model_fields.items():
        annotation = field.annotation
        kind = annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")
        default = field.default if not isinstance(field.default, str) else f'"{field.default}"'
        if isinstance(default, bool):
            default = str(default).lower()
        rows.append(f"| `{name}` | `{kind}` | `{default}` | {config._EXPECTED.get(name, '')} | {docs.get(name, '')} |")
    return CONFIGURATION_HEADER + "\n".join(rows) + "\n"


def cli_page():
    os.environ["COLUMNS"] = HELP_WIDTH
    parser = build_parser()
    commands = next(action for action in parser._actions if action.choices and action.dest == "command")
    sections = [CLI_HEADER, "```text\n" + parser.format_help() + "```\n"]
    for name, subparser in commands.choices.items():
        sections.append(f"## `ds-tsp {name}`\n\n```text\n{subparser.format_help()}```\n")
    return "\n".join(sections)


PAGES = {"configuration.md": configuration_page, "cli.md": cli_page}


def main():
    for name, page in PAGES.items():
        with open(os.path.join(DOCS, name), "w") as f:
            f.write(page())
        print(f"wrote docs/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
