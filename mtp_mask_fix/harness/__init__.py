"""Test harness that exists only in this repo: CPU shims and the tiny real model. Never sent upstream."""
