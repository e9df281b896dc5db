"""Tests of the mtp-mask-fix tool itself (check, apply, refresh, bad input, the committed patch)."""
