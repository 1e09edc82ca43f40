"""Device memory (CUDA) in the client's calls: the copy-engine interface (engine.py), its CUDA (cuda.py) and
host-memory (cpu.py) engines, the staging pool (staging.py) and the pipeline moving values through it
(transfers.py, staged.py)."""
