"""The plugin host: loading plugins, calling their hooks, the device inventory, settings, host facts, logs and the disk cache."""
