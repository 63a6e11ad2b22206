"""Analysis: run folders -> tables (runs), pure statistics (stats), the main claims (claims), causal
studies (causal) and how far training got (context). Imports the floors below it, never report."""
