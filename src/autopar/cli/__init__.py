"""The ``autopar`` command line; docs/cli.md is the contract."""
