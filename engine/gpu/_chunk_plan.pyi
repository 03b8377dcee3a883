import numpy as np

def plan(p_file: np.ndarray, p_off: np.ndarray, p_len: np.ndarray, p_dst: np.ndarray, chunk_bytes: int,
         c_file: np.ndarray, c_seg: np.ndarray, s_pos: np.ndarray, s_off: np.ndarray, s_len: np.ndarray,
         s_dst: np.ndarray) -> tuple[int, int]: ...
