"""Adapter methods behind one interface; see `base.Method`."""
