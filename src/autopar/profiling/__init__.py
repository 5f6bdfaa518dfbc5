"""Measured costs: the profile database and segment profiling (`autopar profile-segments`)."""

from autopar.profiling.db import Entry, ProfileDB, ProfileError, UnitEntry, fingerprint, this_device, unit_fingerprint

__all__ = ["Entry", "ProfileDB", "ProfileError", "UnitEntry", "fingerprint", "this_device", "unit_fingerprint"]
