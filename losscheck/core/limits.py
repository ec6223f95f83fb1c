"""Sizes the loop defaults to; a leaf module, so that option parsing imports no torch."""

ENGINE_BATCH = 4096  # most rows one engine call runs at once by default (memory bound on the tiny fixtures)
