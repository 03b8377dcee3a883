import numpy as np

PIECE_BYTES: int

class SplitReader:
    """Split copies on native threads kept between calls."""

    def __init__(self, threads: int, adaptive: bool = ..., stream: bool = ...) -> None: ...
    @property
    def threads(self) -> int: ...
    @property
    def costs(self) -> list[tuple[float, float]]: ...
    @property
    def sources(self) -> list[tuple[int, int]]: ...
    def copy(
        self,
        fd: int,
        mapping: object | None,
        file_offsets: np.ndarray,
        targets: list[memoryview],
        align: int = ...,
        keep: bool = ...,
        digests: np.ndarray | None = ...,
    ) -> tuple[int, int, int]: ...
    def close(self) -> None: ...
    def __enter__(self) -> SplitReader: ...
    def __exit__(self, *exc: object) -> None: ...
