"""Test-only support: the tiny real megatron-core model with MTP, its workers and CPU runtime workarounds."""
