"""llama.cpp's native HTTP API (llama-server's /completion, /props, /slots) over the one engine front."""
