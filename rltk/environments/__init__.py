"""Environments of multi-turn episodes (kind ``environment``, hook ``rltk_environments``)."""
