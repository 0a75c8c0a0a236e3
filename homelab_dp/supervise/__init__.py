"""Starting, following and stopping runs (torchrun launcher, controller, device monitor)."""
