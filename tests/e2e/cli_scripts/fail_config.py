"""A user's script with the usual first-run mistake: it reads a config file that is not in the image."""
import json

with open("config.json") as f:  # FileNotFoundError: never shipped with the script
    config = json.load(f)
