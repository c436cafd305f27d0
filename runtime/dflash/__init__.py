"""DFlash: the adaptive scheduler's policies (window, cache health, verify balance, tenants,
resources). Each reads statistics only, never the executor."""
