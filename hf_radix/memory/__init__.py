"""Memory pools of hf_radix: paged K/V and per-request fixed-size layer states."""
