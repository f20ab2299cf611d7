"""One update: the state streamed through the devices as a transaction, and the I/O between updates."""
