"""The remote-code files a tiny MiniCPM-o 4.5 directory carries, loaded with trust_remote_code:
the config class, the image processor and the tokenizer, each module standing alone."""
