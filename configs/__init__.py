"""The run presets (`metatrain train PRESET`), installed as package data of `metatrain.configs`."""
