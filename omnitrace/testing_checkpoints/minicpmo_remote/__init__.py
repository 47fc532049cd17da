"""The remote-code files a tiny MiniCPM-o 4.5 directory carries, loaded with trust_remote_code.

Each module stands alone (transformers copies them into the directory one by one and imports
them from there): the config class, the image processor and the tokenizer, written by
omnitrace from the interface vLLM 0.26 calls and from the model's published facts.
"""
