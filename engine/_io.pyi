import numpy as np

def pread_runs(fd: int, dst: np.ndarray | memoryview, src: np.ndarray, run_bytes: int, base: int) -> tuple[int, int, int]: ...

# split copies (one chunk over many native threads) and page-cache residency
def pread_split(
    fd: int,
    dst: np.ndarray | memoryview,
    file_offsets: np.ndarray,
    dst_offsets: np.ndarray,
    sizes: np.ndarray,
    threads: int,
    align: int = ...,
) -> tuple[int, int, int]: ...
def resident_pages(region: np.ndarray | memoryview | bytes) -> tuple[int, int]: ...

class SplitReader:
    """pread_split on native threads kept between reads."""

    def __init__(self, threads: int) -> None: ...
    @property
    def threads(self) -> int: ...
    def read(
        self,
        fd: int,
        dst: np.ndarray | memoryview,
        file_offsets: np.ndarray,
        dst_offsets: np.ndarray,
        sizes: np.ndarray,
        align: int = ...,
    ) -> tuple[int, int, int]: ...
    def close(self) -> None: ...
    def __enter__(self) -> SplitReader: ...
    def __exit__(self, *exc: object) -> None: ...
