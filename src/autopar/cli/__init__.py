"""The ``autopar`` command line; see ../shared/CLI.md for the contract."""
