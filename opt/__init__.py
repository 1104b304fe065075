"""The core: IR, pattern matcher and rule driver, pass manager, remarks, parity.

``opt`` imports nothing from ``passes``, ``rules``, ``targets`` or ``cli``; those register
themselves into the registries defined here.
"""
