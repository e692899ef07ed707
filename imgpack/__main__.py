"""``python -m imgpack``: the same command line as ``imgpack`` (for a venv whose ``bin`` is not
on PATH, or to pick the interpreter: ``python3.12 -m imgpack convert ...``)."""

from imgpack.cli import main

if __name__ == "__main__":
    main(prog_name="imgpack")
