"""The outside world below the tables: database connections and the SQL statements kept compiled per
connection, psycopg loaders, Redis clients, the clock (the time authority) and the background
pass a beat runs off the claim's path."""
