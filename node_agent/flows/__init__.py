"""The agent's flows, one room each over the ledger and the pure policy; `service.Agent` is their facade."""
