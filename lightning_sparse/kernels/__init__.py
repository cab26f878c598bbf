"""Optional compiled CPU loops for mask updates (the ``[cpu]`` extra)."""
