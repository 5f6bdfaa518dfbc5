"""Measured costs: the profile database, segment profiling (`autopar profile-segments`) and op profiling
(`autopar profile-ops`)."""

from autopar.profiling.db import (
    Entry,
    OpEntry,
    ProfileDB,
    ProfileError,
    UnitEntry,
    fingerprint,
    this_device,
    unit_fingerprint,
)

__all__ = ["Entry", "OpEntry", "ProfileDB", "ProfileError", "UnitEntry", "fingerprint", "this_device", "unit_fingerprint"]
