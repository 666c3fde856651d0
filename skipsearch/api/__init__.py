"""One library function per command, the one the command line calls: settings in (each field a flag of the same
name), a typed result out, which the command prints. `from skipsearch import optimize, OptimizeSettings, ...`."""
