"""What runs inside processes that import megatron (never sent upstream): CPU shims and runtime workarounds, the tiny
real MTP model and its workers, the behaviour probe behind `verify`, and the pytest runner and recorder of red/green."""
