# No Python names: the copy engine is native only, cimported (_io.pxd) by the split copies
# (_split), the pread gathers (_spans) and the chunk ring (engine/gpu/_ring.pyx).
