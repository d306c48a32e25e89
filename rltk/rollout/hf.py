"""Placeholder until this plugin module is written; registers nothing yet."""
