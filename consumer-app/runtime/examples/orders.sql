-- The shop's own tables, beside the inbox's schema (any schema works).
CREATE SCHEMA IF NOT EXISTS shop;
CREATE TABLE IF NOT EXISTS shop.payments (order_id bigint PRIMARY KEY, cents bigint NOT NULL);
CREATE TABLE IF NOT EXISTS shop.shipments (order_id bigint PRIMARY KEY);
