"""The comm layer and the protocol under the ops: signals, symmetric memory, the watchdog, agreement, failures,
lifetime, stress, soak."""
