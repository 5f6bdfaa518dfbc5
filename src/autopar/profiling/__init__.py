"""Measured costs: the profile database and segment profiling (`autopar profile-segments`)."""

from autopar.profiling.db import Entry, ProfileDB, ProfileError, fingerprint, this_device

__all__ = ["Entry", "ProfileDB", "ProfileError", "fingerprint", "this_device"]
