"""Pure data and lookups: the phase schedule and parameter selection."""
