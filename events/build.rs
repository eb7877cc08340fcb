fn main() {
    // Migrations are embedded by `sqlx::migrate!`; rebuild when one is added or changed.
    println!("cargo:rerun-if-changed=../migrations");
}
