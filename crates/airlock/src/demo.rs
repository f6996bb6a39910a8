//! The demo SQLite database that `airlock up` serves when no `[[databases]]` are
//! configured: a small shop, enough to try every db tool.

use std::path::Path;

use anyhow::Context;

const SCHEMA: &str = "
CREATE TABLE customers (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    email TEXT NOT NULL UNIQUE,
    created_at TEXT NOT NULL
);
CREATE TABLE products (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    price_cents INTEGER NOT NULL CHECK (price_cents >= 0)
);
CREATE TABLE orders (
    id INTEGER PRIMARY KEY,
    customer_id INTEGER NOT NULL REFERENCES customers(id),
    product_id INTEGER NOT NULL REFERENCES products(id),
    quantity INTEGER NOT NULL DEFAULT 1,
    ordered_at TEXT NOT NULL
);
CREATE INDEX orders_by_customer ON orders(customer_id);
CREATE VIEW order_totals AS
    SELECT c.name AS customer, SUM(o.quantity * p.price_cents) AS total_cents
    FROM orders o JOIN customers c ON c.id = o.customer_id JOIN products p ON p.id = o.product_id
    GROUP BY c.name;
INSERT INTO customers VALUES
    (1, 'Ada Lovelace', 'ada@example.com', '2026-01-05T10:00:00Z'),
    (2, 'Grace Hopper', 'grace@example.com', '2026-02-11T09:30:00Z'),
    (3, 'Alan Turing', 'alan@example.com', '2026-03-20T16:45:00Z');
INSERT INTO products VALUES (1, 'Keyboard', 4900), (2, 'Monitor', 18900), (3, 'Cable', 900);
INSERT INTO orders VALUES
    (1, 1, 1, 1, '2026-04-01T12:00:00Z'),
    (2, 1, 3, 3, '2026-04-01T12:00:00Z'),
    (3, 2, 2, 2, '2026-04-03T08:15:00Z'),
    (4, 3, 1, 1, '2026-04-07T17:20:00Z');
";

/// Creates the demo database at `path` unless it exists (atomically: built in a temp
/// file, then renamed).
pub fn ensure_demo_database(path: &Path) -> anyhow::Result<()> {
    if path.exists() {
        return Ok(());
    }
    let dir = path
        .parent()
        .context("the demo database path has no directory")?;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let tmp = dir.join(".demo.db.tmp");
    let _ = std::fs::remove_file(&tmp);
    {
        let connection =
            rusqlite::Connection::open(&tmp).context("cannot create the demo database")?;
        connection
            .execute_batch(SCHEMA)
            .context("cannot fill the demo database")?;
    }
    std::fs::rename(&tmp, path).context("cannot move the demo database into place")?;
    Ok(())
}
