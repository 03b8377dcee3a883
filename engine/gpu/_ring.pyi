import numpy as np

from engine.gpu._cudart import Runtime

class ChunkRing:
    """Page-locked chunks and native copy threads on one device and stream."""

    def __init__(
        self,
        runtime: Runtime,
        device: int,
        stream: int,
        chunk_bytes: int,
        chunks: int,
        threads: int,
        stream_owner: object = ...,
    ) -> None: ...
    @property
    def threads(self) -> int: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def chunks(self) -> int: ...
    @property
    def locked_bytes(self) -> int: ...
    @property
    def pageable(self) -> bool: ...
    @property
    def last_run(self) -> dict[str, float]: ...
    def lock_all(self) -> tuple[float, int]: ...
    def run(
        self,
        c_file: np.ndarray,
        c_seg: np.ndarray,
        s_pos: np.ndarray,
        s_off: np.ndarray,
        s_len: np.ndarray,
        s_dst: np.ndarray,
        fds: np.ndarray,
        maps: np.ndarray,
        map_lens: np.ndarray,
        keeps: np.ndarray,
        poll: object = ...,
        poll_seconds: float = ...,
        adaptive: bool = ...,
        stream_stores: bool = ...,
        d_off: np.ndarray | None = ...,
        d_len: np.ndarray | None = ...,
        d_first: np.ndarray | None = ...,
        d_cell: np.ndarray | None = ...,
        cells: np.ndarray | None = ...,
        wait_for: int | None = ...,
    ) -> tuple[int, int, int, int, int]: ...
    def close(self) -> None: ...
    def stop(self) -> None: ...
    def put(self, dst: int, src: object) -> None: ...
    def abandon(self) -> None: ...
    def __enter__(self) -> ChunkRing: ...
    def __exit__(self, *exc: object) -> None: ...
