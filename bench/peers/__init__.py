"""conveyor against its peers (llama.cpp, ik_llama.cpp, transformers) on the same weights."""
