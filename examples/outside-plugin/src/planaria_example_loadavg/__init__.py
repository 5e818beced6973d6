"""An example third-party planaria plugin: a health check of the CPU load average."""
