"""Builds the offline browser bundle (dist/web/) and serves it: `python -m wasm build|serve`."""
