"""Paged attention's batch metadata, shared-prefix planning and MLA latents."""
